"""Version of the layertap distribution and of the wire API it speaks."""

__version__ = "0.1.0"

#: The protobuf package version the client speaks (``layertap.v1``).
API_VERSION = "v1"
