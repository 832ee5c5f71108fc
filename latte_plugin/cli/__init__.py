"""The user's commands, in the package so that an installed wheel has them: ``tools/<name>.py``
in a checkout runs each (``python tools/calibrate.py --help``), as does
``python -m latte_plugin.cli.<name>`` anywhere."""
