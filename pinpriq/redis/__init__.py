"""The Redis store: queues in Redis or Redis Cluster, shared by many pinpriq front ends."""
