"""What a run config may name: the registries of every kind of component with their options
and capabilities (registry), the declarations of the server's parts (server_parts) and
the import of a component by its path (importing)."""
