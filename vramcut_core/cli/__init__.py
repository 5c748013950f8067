"""The command line (``python -m vramcut_core``): ``commands`` (``plan`` from a file's header,
``demo``) and ``demo`` (a built-in seeded transformer run plain and segmented)."""
