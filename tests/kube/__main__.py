"""``python -m kube apiserver DIR PORTFILE`` or ``python -m kube controller DIR`` (run from tests/)."""

import sys
from pathlib import Path

if sys.argv[1] == "apiserver":
    from .apiserver import serve

    serve(Path(sys.argv[2]), Path(sys.argv[3]))
else:
    from .cluster import controller_main

    sys.exit(controller_main(Path(sys.argv[2])))
