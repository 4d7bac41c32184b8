"""The noaux_tc router (scores, biased top-k, renormalised weights) as one op: ``api.route_topk``."""
