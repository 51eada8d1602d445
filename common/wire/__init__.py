"""The bytes and messages both sides share: tensors on the wire (tensors), codecs (codecs), the
messages' sizes (sizes), task plans and results as plain values (plans) and their converter to
and from protobuf (serde), the protocol's version and status codes (protocol), TLS and
credentials (security), client id ranges (client_ids) and addresses (addresses)."""
