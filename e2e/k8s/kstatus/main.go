// gpuledger-kstatus reads Kubernetes objects as JSON on stdin (one object, or a List as
// `kubectl get -o json` prints it) and prints, for each, the status that kstatus computes: the
// library Flux and kpt use to decide whether an applied object is healthy. The end-to-end tests
// run it on the objects the operator and the device plugin wrote, so our conditions are judged
// by the real rules rather than by our reading of them.
//
// One JSON line per object: {"kind", "namespace", "name", "status", "message"}.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	kjson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type verdict struct {
	Kind      string `json:"kind"`
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name"`
	Status    string `json:"status"`
	Message   string `json:"message"`
}

func main() {
	if err := run(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "gpuledger-kstatus:", err)
		os.Exit(1)
	}
}

func run(in io.Reader, out io.Writer) error {
	raw, err := io.ReadAll(in)
	if err != nil {
		return fmt.Errorf("reading stdin: %w", err)
	}
	// apimachinery's decoder keeps integers as int64, which the accessors kstatus uses expect.
	var doc map[string]interface{}
	if err := kjson.Unmarshal(raw, &doc); err != nil {
		return fmt.Errorf("stdin is not a JSON object: %w", err)
	}
	objects := []map[string]interface{}{doc}
	if items, ok := doc["items"].([]interface{}); ok {
		objects = objects[:0]
		for i, item := range items {
			obj, ok := item.(map[string]interface{})
			if !ok {
				return fmt.Errorf("items[%d] is not an object", i)
			}
			objects = append(objects, obj)
		}
	}
	enc := json.NewEncoder(out)
	for _, obj := range objects {
		u := &unstructured.Unstructured{Object: obj}
		res, err := status.Compute(u)
		if err != nil {
			return fmt.Errorf("%s %s/%s: %w", u.GetKind(), u.GetNamespace(), u.GetName(), err)
		}
		v := verdict{
			Kind:      u.GetKind(),
			Namespace: u.GetNamespace(),
			Name:      u.GetName(),
			Status:    res.Status.String(),
			Message:   res.Message,
		}
		if err := enc.Encode(v); err != nil {
			return fmt.Errorf("writing: %w", err)
		}
	}
	return nil
}
