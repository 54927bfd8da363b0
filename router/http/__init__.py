"""The router's OpenAI-compatible HTTP door (``--http-port``): app.py (routes), frontend.py (request
translation onto the gRPC servicer's path), responses.py (answers and stream chunks), errors.py
(gRPC status → HTTP status, OpenAI error bodies), schemas.py (request bodies), server.py (uvicorn
in the router's loop)."""
