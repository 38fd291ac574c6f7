"""Redraw a run's metrics.png from its metrics.csv: record.metrics does the drawing.

python -m {{ cookiecutter.package }}.metrics outputs/<run>
"""

import sys

from .record.metrics import main

if __name__ == "__main__":
    sys.exit(main())
