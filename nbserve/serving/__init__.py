"""Serving: the FastAPI app, launch/serve and the `Server` handle, the swappable backend
behind `update()`, share links, the Gradio UI, metrics and the command line.

Nothing is imported here, so that `import nbserve` stays fast (gradio alone takes seconds).
"""
