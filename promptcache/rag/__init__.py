"""Retrieval-augmented generation: documents reused in any subset and order (default) or as exact chains.

    store.py      ``DocumentStore``: the documents and their prompt plans (reuse, exact chains)
    folder.py     ``DocumentFolder``: a store's persisted folder (index.json + states files)
    documents.py  ``Document``, ``DocumentStoreError``, ``UnknownDocumentError``

``from promptcache.rag import DocumentStore`` is the way in (``store.py``'s docstring says how the
modes work).
"""

from .documents import Document, DocumentStoreError, UnknownDocumentError
from .folder import FORMAT_VERSION, INDEX, DocumentFolder
from .store import DocumentStore

__all__ = ["FORMAT_VERSION", "INDEX", "Document", "DocumentFolder", "DocumentStore", "DocumentStoreError",
           "UnknownDocumentError"]
