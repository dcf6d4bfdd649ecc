"""The pserver wire, both ends of it: the frame format (``protocol``), a connection's MAC-tagged frames
(``stream``), trainer identities and the handshake (``auth``) and Poly1305 (``poly1305``)."""
