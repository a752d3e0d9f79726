"""One store per node, shared by every engine process on it: ``tierstore serve`` and its client.

:mod:`.server` owns the node's tiers; :mod:`.client` gives other processes the store API through a Unix
socket (:mod:`.protocol`) and shared memory (:mod:`.shm`); :mod:`.access` decides who may connect.
"""
