"""Pictures of layouts: ``visualize_sharding`` and the PNG drawer (``sharding.py``), and the
optional libraries they draw with, ``rich`` and matplotlib (``optional.py``)."""
