"""The serving core: the paged KV pool (``kvpool``), prefix chains (``chains``, ``prefix``),
requests as data (``request``, ``prompts``), the step loop (``scheduler``), paged attention
(``paged``) with the native CPU kernel (``kernels/attention.py``), the step graphs
(``graphs``: torch.compile'd steps) and ``core.Engine``, which the library and the server drive.
"""
