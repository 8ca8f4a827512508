"""The disk store (``eagleflow.stores.disk.store``)."""
