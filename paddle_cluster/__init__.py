"""paddle-cluster: an SSH launcher and a numpy parameter-server runtime.

The node side (``contract``, ``ps``, ``train``, ``node``) needs only Python and numpy and never
imports the launcher (``launch``, ``cli``), which is what needs Fabric.
"""

__version__ = "0.1.0"
