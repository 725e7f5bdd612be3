"""What several test modules build, defined once: the `ficco` command for tests (``cli``),
hand-made exported selectors (``exports``), a hand-made GPU profile (``profiles``), a
Llama-style block with its tensor-parallel plans (``llama``), the gloo ranks the torch ops'
tests run on (``ranks``), the executor tests' scenarios (``scenarios``) and datasets cut
from the committed cpu sweep (``datasets``). Test modules import from here, never from each
other; fixtures shared across modules are in ``conftest.py``."""
