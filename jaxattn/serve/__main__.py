"""``python -m jaxattn.serve``: see ``jaxattn.serve.cli``."""

from jaxattn.serve.cli import main

main()
