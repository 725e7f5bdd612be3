"""What a framework job imports: the runtime selector, the torch ops, the TP hooks (README.md)."""
