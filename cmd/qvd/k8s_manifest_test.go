package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/qvd/qvd/job"
	"github.com/qvd/qvd/launch"
)

// TestKubernetesManifest checks deploy/kubernetes/qvd-job.yaml as far as can be done without a
// cluster: the objects parse and fit together (an Indexed Job whose pods the headless Service
// names, as many pods as WORLD_SIZE, MASTER_ADDR naming pod 0), each pod's environment —
// RANK filled in as Kubernetes fills it from the completion index — plans the process qvd
// would run (rank 0 coordinates on MASTER_PORT, the others join qvd-0.qvd), and the
// container's arguments are flags `qvd train` accepts.
func TestKubernetesManifest(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "deploy", "kubernetes", "qvd-job.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	type envVar struct {
		Name      string `yaml:"name"`
		Value     string `yaml:"value"`
		ValueFrom struct {
			FieldRef struct {
				FieldPath string `yaml:"fieldPath"`
			} `yaml:"fieldRef"`
			SecretKeyRef struct {
				Name string `yaml:"name"`
			} `yaml:"secretKeyRef"`
		} `yaml:"valueFrom"`
	}
	type object struct {
		Kind     string `yaml:"kind"`
		Metadata struct {
			Name string `yaml:"name"`
		} `yaml:"metadata"`
		Spec struct {
			ClusterIP      string            `yaml:"clusterIP"`
			Selector       map[string]string `yaml:"selector"`
			CompletionMode string            `yaml:"completionMode"`
			Completions    int               `yaml:"completions"`
			Parallelism    int               `yaml:"parallelism"`
			Ports          []struct {
				Port int `yaml:"port"`
			} `yaml:"ports"`
			Template struct {
				Metadata struct {
					Labels map[string]string `yaml:"labels"`
				} `yaml:"metadata"`
				Spec struct {
					Subdomain  string `yaml:"subdomain"`
					Containers []struct {
						Args []string `yaml:"args"`
						Env  []envVar `yaml:"env"`
					} `yaml:"containers"`
				} `yaml:"spec"`
			} `yaml:"template"`
		} `yaml:"spec"`
	}
	var svc, jobObj *object
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	dec.KnownFields(false)
	for {
		var o object
		if err := dec.Decode(&o); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("qvd-job.yaml: %v", err)
		}
		switch o.Kind {
		case "Service":
			svc = &o
		case "Job":
			jobObj = &o
		}
	}
	if svc == nil || jobObj == nil {
		t.Fatal("qvd-job.yaml: want a Service and a Job")
	}
	js := jobObj.Spec
	if svc.Spec.ClusterIP != "None" || js.CompletionMode != "Indexed" || js.Template.Spec.Subdomain != svc.Metadata.Name {
		t.Fatalf("want a headless Service naming an Indexed Job's pods: clusterIP %q, completionMode %q, subdomain %q",
			svc.Spec.ClusterIP, js.CompletionMode, js.Template.Spec.Subdomain)
	}
	for k, v := range svc.Spec.Selector {
		if js.Template.Metadata.Labels[k] != v {
			t.Errorf("the Service selects %s=%s, which the Job's pods do not carry", k, v)
		}
	}
	if len(js.Template.Spec.Containers) != 1 {
		t.Fatalf("want one container, got %d", len(js.Template.Spec.Containers))
	}
	c := js.Template.Spec.Containers[0]
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.Name == "RANK":
			if e.ValueFrom.FieldRef.FieldPath != "metadata.annotations['batch.kubernetes.io/job-completion-index']" {
				t.Errorf("RANK comes from %q, not the completion index", e.ValueFrom.FieldRef.FieldPath)
			}
		case e.Name == job.ClusterKeyEnv:
			if e.ValueFrom.SecretKeyRef.Name == "" {
				t.Errorf("%s is not taken from a Secret", job.ClusterKeyEnv)
			}
		default:
			env[e.Name] = e.Value
		}
	}
	world, err := strconv.Atoi(env["WORLD_SIZE"])
	if err != nil || world != js.Completions || world != js.Parallelism {
		t.Fatalf("WORLD_SIZE %q, completions %d, parallelism %d: want the same number", env["WORLD_SIZE"], js.Completions, js.Parallelism)
	}
	if want := fmt.Sprintf("%s-0.%s", jobObj.Metadata.Name, svc.Metadata.Name); env["MASTER_ADDR"] != want {
		t.Errorf("MASTER_ADDR %q, want pod 0's name %q", env["MASTER_ADDR"], want)
	}
	if len(svc.Spec.Ports) == 0 || strconv.Itoa(svc.Spec.Ports[0].Port) != env["MASTER_PORT"] {
		t.Errorf("the Service's port and MASTER_PORT %q differ", env["MASTER_PORT"])
	}
	for rank := range world {
		getenv := func(k string) string {
			if k == "RANK" {
				return strconv.Itoa(rank)
			}
			return env[k]
		}
		p, ok, err := launch.PlanTorchrun(getenv)
		if err != nil || !ok {
			t.Fatalf("pod %d: planTorchrun = %v, %v", rank, ok, err)
		}
		if p.Rank != rank || p.World != world || p.Coordinator != (rank == 0) || p.Peer != env["MASTER_ADDR"]+":"+env["MASTER_PORT"] {
			t.Errorf("pod %d: plan %+v", rank, p)
		}
	}
	// The arguments: `train` and flags qvd train accepts (`qvd config` takes the same run
	// flags; --resume is train's own).
	if len(c.Args) == 0 || c.Args[0] != "train" {
		t.Fatalf("container args %q: want train first", c.Args)
	}
	args := slices.Clone(c.Args[1:])
	if i := slices.Index(args, "--resume"); i >= 0 {
		if args[i+1] != "auto" {
			t.Errorf("--resume %q: want auto, so a resubmitted Job resumes", args[i+1])
		}
		args = slices.Delete(args, i, i+2)
	}
	if code, _, errs := runQVD(t, append([]string{"config"}, args...)...); code != exitOK {
		t.Fatalf("qvd config %s: exit %d\n%s", strings.Join(args, " "), code, errs)
	}
}
