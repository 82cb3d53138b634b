"""Host -> global -> host, one stage per module, in the order data flows:

``call.py`` (the call: one tree per host, flattened; its plan record) -> ``host_data.py`` (the
leaves a call may pass, as CPU tensors) -> ``validate.py`` (every check before anything moves,
and each leaf's plan) -> ``cache.py`` (plans kept per call signature) -> ``views.py`` (the view
each device receives) -> ``place.py`` (plans bound to the backend, views handed to it) ->
``replicas.py`` (hosts that share a block pass equal values, under ``virtual_hosts``);
``readback.py`` reads global tensors back. The entry points are ``host_to_global.py`` and
``readback.py``."""
