"""Measuring schedules on real ranks: timing policy (``config``), one scenario on one rank
(``harness``), the rank launchers (``gloo`` for the cpu backend, ``node`` for the cuda
backend's process per GPU), virtual ranks on one device (``loopback``, one scenario on them: ``loopback_scenario``), and the sweep that
writes a crash-safe dataset (``sweep``). Imports torch; only measuring tools import it."""
