// Command cgroupprobe is run by TestCgroupLimitInContainer inside a container started with
// --memory: it prints, as JSON, what memstat reads before and after it touches 64 MiB, and
// after a child of its own ("cgroupprobe hog") has been OOM-killed in the same cgroup.
// Built with CGO_ENABLED=0 so that it runs from an image built FROM scratch.
package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"time"

	"github.com/qvd/qvd/internal/memstat"
)

// touched is held until the end, so that the second reading sees it.
var touched []byte

func main() {
	if len(os.Args) > 1 && os.Args[1] == "hog" {
		hog()
		return
	}
	r := memstat.NewReader()
	defer r.Close()
	var out struct {
		Before, After, AfterOOM memstat.Snapshot
		Child                   string
	}
	out.Before = r.Read()
	touched = make([]byte, 64<<20)
	for i := range touched {
		touched[i] = 1
	}
	out.After = r.Read()
	// The child grows until the cgroup's OOM killer takes it (it asks to be the victim).
	cmd := exec.Command("/proc/self/exe", "hog")
	if err := cmd.Start(); err != nil {
		out.Child = "start: " + err.Error()
	} else {
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			out.Child = "exited"
			if err != nil {
				out.Child = err.Error()
			}
		case <-time.After(15 * time.Second):
			cmd.Process.Kill()
			<-done
			out.Child = "not killed within 15 s"
		}
	}
	out.AfterOOM = r.Read()
	touched[0]++
	json.NewEncoder(os.Stdout).Encode(out)
}

func hog() {
	os.WriteFile("/proc/self/oom_score_adj", []byte("1000"), 0) // the OOM killer's first choice
	var held [][]byte
	for range 256 { // up to 4 GiB, far past any limit the test sets
		b := make([]byte, 16<<20)
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		held = append(held, b)
	}
	os.Exit(3) // not killed
}
