"""``python -m opdistill ...`` (and ``torchrun ... -m opdistill train ...``): the command line of opdistill.cli."""
import sys

from opdistill.cli import main

if __name__ == "__main__":
    sys.exit(main())
