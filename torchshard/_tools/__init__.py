"""The tools on top of the library: the command line (``python -m torchshard``), the demo and
the benchmarks. They use the public API, plus the engine and the torch_xla backend's wrapped
private calls where a benchmark needs a baseline; nothing in the library imports them."""
