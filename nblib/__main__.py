"""`python -m nblib <verb>`: see nblib.cli."""
import sys

from nblib.cli import main

if __name__ == "__main__":
    sys.exit(main())
