"""What runs on the allocated nodes: rank facts, the process group, the job entry point.

Nothing here imports the render or submit side.
"""
