"""The engine API's protobuf messages, generated at build time from gateway/proto/kvgate.proto."""
