"""Inside the step: ``constraint.py`` (``with_sharding_constraint``, ``maybe_shard``),
``dispatch.py`` (from a padded physical batch to the logical one), and the two dispatchers,
``input_dispatcher.py`` (padding on the host, the row-target key) and
``spmd_input_dispatcher.py`` (feeds from the mesh), which implement ``protocol.py``'s
``Dispatcher``."""
