"""What several test modules build: the CLI runner and its checks (``cli``). Test modules
import from here, never from each other."""
