"""Stand-in for ``google.cloud.storage`` when EasyDeL's eSurge runs as a benchmark peer: eformer's
``paths`` module imports it at the top for ``gs://`` paths, which the benchmark never opens."""


class Client:
    def __init__(self, *args, **kwargs):
        raise ImportError("google-cloud-storage is not installed: gs:// paths are unsupported here")


class Blob:
    pass


class Bucket:
    pass
