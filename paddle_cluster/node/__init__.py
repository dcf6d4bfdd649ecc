"""What runs on a node (standard library only)."""

# ``python -c MAIN LIB ARGS...`` runs ``python -m paddle_cluster.node ARGS`` from the library in directory LIB (the
# one the launcher dispatched), whatever ``paddle_cluster`` the interpreter itself may have installed, or not.
MAIN = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
        "from paddle_cluster.node.__main__ import main; sys.exit(main())")
