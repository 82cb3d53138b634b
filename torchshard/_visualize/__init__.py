"""Pictures of layouts: ``visualize_sharding`` and the PNG drawer (``sharding.py``), which draw
with the optional libraries ``rich`` and matplotlib (``torchshard._core.optional``)."""
