"""The pserver (``pserver.PServer``, ``pserver.serve``): its sockets (``net``), the ops (``handlers``,
``declare``) on its ``state``, its shards -- dense blocks (``dense``) and table shards (``table``), each with its
step (``shard``) -- the trainers' membership and order (``sync``), its memory ``budget``, finite values
(``finite``) and resuming from a checkpoint (``resume``)."""
