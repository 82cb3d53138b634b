"""torchshard's exchanges between processes: a tree of the processes over TCP connections of
its own, bootstrapped once through the job's key-value store.

``tree.py`` (who is whose parent), ``wire.py`` (frames), ``merge.py`` (values and how they
merge), ``node.py`` (a process's connections, I/O thread, exchanges, floods and surveys),
``session.py`` (calls numbered per stream, the exchanges' API and their errors). Standard
library only (and ``_core``): a backend supplies the bootstrap (DTensor: the default group's
store; torchax: JAX's coordination service).
"""
