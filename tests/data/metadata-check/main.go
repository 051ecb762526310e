// metadata-check: reads KEP-5304 device metadata files as upstream does (k8s.io/dynamic-resource-allocation
// v0.37.2): each object of the stream decoded strictly (an unknown field is an error) and validated
// (Validate_DeviceMetadata of its version), then the stream read through devicemetadata.DecodeMetadataFromStream
// into the v1beta1 and the v1alpha1 type, with its validation. Prints "<file>: ok [versions]" or
// "<file>: REFUSED: why" per file; exits 1 if any was refused.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"

	"k8s.io/apimachinery/pkg/api/operation"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/dynamic-resource-allocation/api/metadata/install"
	metadatav1alpha1 "k8s.io/dynamic-resource-allocation/api/metadata/v1alpha1"
	metadatav1beta1 "k8s.io/dynamic-resource-allocation/api/metadata/v1beta1"
	"k8s.io/dynamic-resource-allocation/devicemetadata"
)

func check(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	scheme := install.NewScheme()
	strict := kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme, scheme, kjson.SerializerOptions{Strict: true})
	dec := json.NewDecoder(bytes.NewReader(data))
	var versions []string
	for dec.More() {
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return "", fmt.Errorf("read stream: %w", err)
		}
		obj, gvk, err := strict.Decode(raw, nil, nil)
		if err != nil {
			return "", fmt.Errorf("strict decode: %w", err)
		}
		var verr error
		switch o := obj.(type) {
		case *metadatav1beta1.DeviceMetadata:
			verr = metadatav1beta1.Validate_DeviceMetadata(context.Background(), operation.Operation{Type: operation.Create}, nil, o, nil).ToAggregate()
		case *metadatav1alpha1.DeviceMetadata:
			verr = metadatav1alpha1.Validate_DeviceMetadata(context.Background(), operation.Operation{Type: operation.Create}, nil, o, nil).ToAggregate()
		default:
			return "", fmt.Errorf("unexpected %s", gvk)
		}
		if verr != nil {
			return "", fmt.Errorf("%s: validation: %w", gvk.GroupVersion(), verr)
		}
		versions = append(versions, gvk.GroupVersion().String())
	}
	// As a reader of the stream gets it, into either version's type.
	for _, dest := range []runtime.Object{&metadatav1beta1.DeviceMetadata{}, &metadatav1alpha1.DeviceMetadata{}} {
		var got schema.GroupVersionKind
		var verr error
		if err := devicemetadata.DecodeMetadataFromStream(json.NewDecoder(bytes.NewReader(data)), dest,
			devicemetadata.DecodeMetadataWithValidationResult(&verr), devicemetadata.DecodeMetadataStoreGVKResult(&got)); err != nil {
			return "", fmt.Errorf("DecodeMetadataFromStream into %T: %w", dest, err)
		}
		if verr != nil {
			return "", fmt.Errorf("DecodeMetadataFromStream into %T: validation: %w", dest, verr)
		}
	}
	out, _ := json.Marshal(versions)
	return string(out), nil
}

func main() {
	failed := false
	for _, path := range os.Args[1:] {
		versions, err := check(path)
		if err != nil {
			fmt.Printf("%s: REFUSED: %v\n", path, err)
			failed = true
			continue
		}
		fmt.Printf("%s: ok %s\n", path, versions)
	}
	if failed {
		os.Exit(1)
	}
}
