"""What provision and checks share on the host.

Cell ids, the matrix and catalog, resolution, the reason catalogue, progress.
"""
