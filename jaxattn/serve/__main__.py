"""``python -m jaxattn.serve``: see ``jaxattn.serve.cli``."""

from jaxattn.serve.cli import main

if __name__ == "__main__":
    main()
