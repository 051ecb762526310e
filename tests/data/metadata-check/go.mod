module metadatacheck

go 1.24

require k8s.io/dynamic-resource-allocation v0.37.2
