"""The application without sockets: a call (method, canonical path, headers, body, arrival
time, the client's address) in, a reply (whole, streamed, or pending) out.

- ``call.py``: the call and reply types;
- ``routes.py``: the one route table of every HTTP entry;
- ``context.py``: a request's id and trace context, the answers' headers;
- ``checks.py``: the URL, header and body limits every entry applies;
- ``application.py``: ``Application``, which routes a call to its reply;
- ``v2.py``: the V2 routes (the generative ones are ``server/generative.py``);
- ``grpc_service.py``: the V2 gRPC service, its handlers and ``GRPC_ROUTES`` (a method's
  path -> its handler, request parser and answer serializer).

Adapters (``server/rest.py`` for HTTP/1.1, ``ray.py``, ``serverless.py``; for gRPC,
``server/grpc.py`` on grpcio and ``server/grpc_h2.py`` on our own HTTP/2) convert their
I/O into calls and send the replies.
"""
