"""A built cell as both sides read it: where cells are built and run (``backend``: Docker or venv), the build
record and its one reader (``buildrecord``), the CUDA toolkit a venv cell shows its code (``celltoolkit``), and
the state of the kernel stage `provision build` leaves running (``kernelstage``)."""
