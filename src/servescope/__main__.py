"""``python -m servescope`` is the same as the ``servescope`` console script."""

from servescope.cli import main

if __name__ == "__main__":
    main()
