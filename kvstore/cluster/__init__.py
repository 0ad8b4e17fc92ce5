"""A node's membership in a kvstore cluster on etcd (registration.py).

Placement and the membership view are shared with clients and live in the client SDK
(kvstore_client/placement.py, kvstore_client/membership.py): nodes and clients must
compute the same placement from the same records.
"""
