package job

import (
	"fmt"
	"io"
	"os"
	"sync"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Logger is a job's logger and what ends it.
type Logger struct {
	Log *zap.Logger
	// Close flushes the logger and closes its file; Err is the file's first write error.
	Close func()
	Err   func() error
}

// watchedFile is the log file, keeping its first write error: zap only prints such an
// error to stderr and carries on, where a run that cannot log must stop.
type watchedFile struct {
	f    *os.File
	path string
	mu   struct {
		sync.Mutex
		err error
	}
}

func (w *watchedFile) Write(p []byte) (int, error) {
	n, err := w.f.Write(p)
	if err != nil {
		w.mu.Lock()
		if w.mu.err == nil {
			w.mu.err = fmt.Errorf("writing log file %s: %w", w.path, err)
		}
		w.mu.Unlock()
	}
	return n, err
}

func (w *watchedFile) Sync() error { return w.f.Sync() }

func (w *watchedFile) Err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.mu.err
}

// NewLogger logs human-readable lines to w and, if path is not empty, JSON lines to path.
func NewLogger(w io.Writer, path string, level zapcore.Level) (Logger, error) {
	console := zap.NewDevelopmentEncoderConfig()
	console.EncodeTime = zapcore.TimeEncoderOfLayout("15:04:05")
	console.EncodeCaller = nil
	cores := []zapcore.Core{zapcore.NewCore(zapcore.NewConsoleEncoder(console), zapcore.AddSync(w), level)}
	var file *os.File
	var watched *watchedFile
	if path != "" {
		var err error
		if file, err = os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err != nil {
			return Logger{}, fmt.Errorf("opening log file: %w", err)
		}
		watched = &watchedFile{f: file, path: path}
		jsonCfg := zap.NewProductionEncoderConfig()
		jsonCfg.EncodeTime = zapcore.ISO8601TimeEncoder
		cores = append(cores, zapcore.NewCore(zapcore.NewJSONEncoder(jsonCfg), watched, zapcore.DebugLevel))
	}
	log := zap.New(zapcore.NewTee(cores...))
	lg := Logger{Log: log, Close: func() {
		_ = log.Sync()
		if file != nil {
			_ = file.Close()
		}
	}, Err: func() error { return nil }}
	if watched != nil {
		lg.Err = watched.Err
	}
	return lg, nil
}
