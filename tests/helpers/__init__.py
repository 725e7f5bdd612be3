"""What several test modules build, defined once: the `ficco` command for tests (``cli``),
hand-made exported selectors (``exports``), a hand-made GPU profile (``profiles``) and a
Llama-style block with its tensor-parallel plans (``llama``). Test modules import from here
(and from ``torch_ranks``, the gloo ranks the torch ops' tests run on), never from each
other; fixtures shared across modules are in ``conftest.py``."""
