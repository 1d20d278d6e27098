"""The studio: GET /studio (a web page) and its JSON API under /studio/api.

    routes.py     the routes: schema and prompt views, a full-prefill baseline run, the cache view
    views.py      schema and prompt layouts -> the spans the page draws
    cache.py      ``Traffic`` (recent requests per namespace) and the pool's blocks by owner

Stands on ``core/`` and ``openai/`` (the preparer renders chats as the chat route does).
"""
