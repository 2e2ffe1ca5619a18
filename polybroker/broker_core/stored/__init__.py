"""Generated protobuf code of the stored message format (see ``stored_message.proto``)."""
