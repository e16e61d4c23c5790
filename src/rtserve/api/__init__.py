"""The application without sockets: a call (method, canonical path, headers, body, arrival
time, the client's address) in, a reply (whole, streamed, or pending) out.

- ``call.py``: the call and reply types;
- ``routes.py``: the one route table of every HTTP entry;
- ``context.py``: a request's id and trace context, the answers' headers;
- ``checks.py``: the URL, header and body limits every entry applies;
- ``application.py``: ``Application``, which routes a call to its reply;
- ``v2.py``: the V2 routes (the generative ones are ``server/generative.py``).

Adapters (``server/rest.py`` for HTTP/1.1, ``server/grpc.py``, ``ray.py``,
``serverless.py``) convert their I/O into calls and send the replies.
"""
