import os

# Ranks talk over loopback; set before any process group starts.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
