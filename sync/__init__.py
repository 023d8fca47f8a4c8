"""Weight sync: everything both ends of a transfer share, and the transports between them.

The learner publishes (`publisher`), the engines receive (`receive`); both use one bucket layout (`layout`), the
shared-memory buffer (`shared_memory`), the collective group (`group`) and the fingerprints (`fingerprint`). The
driver moves weights with a transport (`transport`), checks what arrived (`verify`) and calls actors with deadlines
(`calls`). Imports nothing of `actors/`, `learner/` or `cluster/`: it sits below them, so that neither end imports
the other.
"""
