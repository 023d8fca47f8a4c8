"""Weight sync: everything both ends of a transfer share, and the transports between them.

The learner publishes (`publisher`), the engines receive (`receive`); both use one bucket layout (`layout`), the
shared-memory buffer (`shared_memory`), the collective group (`group`) and the fingerprints (`fingerprint`). The
driver's weight sync (cluster/fleet/weight_sync.py) moves weights with a transport (`transport`) and checks what
arrived (`verify`); `calls` calls actors with a deadline, and `config` holds the settings. Imports nothing of
`actors/`, `learner/` or `cluster/`: it sits below them, so that neither end imports the other.
"""
