"""``python -m staticpipe.capabilities``: the one line CI prints first. A ``__main__`` of its own because
``staticpipe`` imports ``capabilities``, and runpy warns when it re-runs a module already imported."""
from . import describe

print(describe())
