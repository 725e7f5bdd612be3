"""GPU profiles: measure one CUDA GPU's primitives (``run``) and read the result (``read``).

``python -m ficco_select.data.gpu_profile.run`` writes ``profile.json`` (format: ``data/profiles/README.md``);
``read`` validates one and turns it into a hardware spec (``ficco hardware from-profile``).
Measuring imports torch and the executor, never ``features``, ``train`` or the runtime
(``tests/test_import_graph.py``); nothing in ``ficco_select`` imports this package.
"""
