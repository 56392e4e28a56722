package telemetry

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"

	nrilog "github.com/containerd/nri/pkg/log"
	"github.com/sirupsen/logrus"
	cli "github.com/urfave/cli/v3"
	"k8s.io/klog/v2"
)

// LogOptions are the logging flags of every binary.
type LogOptions struct {
	// Verbosity follows klog's convention: 0 logs Info and above, 4 and more adds Debug; client-go's
	// klog.V(n) lines appear from -v=n on.
	Verbosity int
	// Format is text or json.
	Format string
}

// AddFlags declares -v and --log-format.
func (o *LogOptions) AddFlags(fs *flag.FlagSet) {
	fs.IntVar(&o.Verbosity, "v", 0, "log verbosity: 0 info and above, 4 and more debug (also client-go's klog.V(n) lines)")
	fs.StringVar(&o.Format, "log-format", "text", "log format: text or json")
}

// Setup builds the process's logger on w, makes it slog's default and routes klog, NRI's logger and
// logrus into it, so one format and one level cover every line the process writes.
func (o LogOptions) Setup(w io.Writer) (*slog.Logger, error) {
	if o.Verbosity < 0 {
		return nil, fmt.Errorf("-v must be >= 0, got %d", o.Verbosity)
	}
	// slog's Debug is level -4, and klog's V(n) reaches slog at level -n: one scale for both.
	opts := &slog.HandlerOptions{Level: slog.Level(-o.Verbosity), ReplaceAttr: verbosityName}
	var h slog.Handler
	switch o.Format {
	case "text", "":
		h = slog.NewTextHandler(w, opts)
	case "json":
		h = slog.NewJSONHandler(w, opts)
	default:
		return nil, fmt.Errorf("--log-format must be text or json, got %q", o.Format)
	}
	log := slog.New(h)
	slog.SetDefault(log)

	// klog checks its own -v before it calls the slog bridge, so it must know the verbosity too.
	var kfs flag.FlagSet
	klog.InitFlags(&kfs)
	if err := kfs.Set("v", strconv.Itoa(o.Verbosity)); err != nil {
		return nil, fmt.Errorf("set klog verbosity: %w", err)
	}
	klog.SetSlogLogger(log)

	nrilog.Set(NRILogger(log))

	routeLogrus(logrus.StandardLogger(), log)
	return log, nil
}

// Logrus returns a logrus logger whose entries go to log, for an API that wants one (the NVIDIA
// Container Toolkit's CDI hook commands); Setup routes logrus's standard logger the same way.
func Logrus(log *slog.Logger) *logrus.Logger {
	l := logrus.New()
	routeLogrus(l, log)
	return l
}

// routeLogrus makes l write nothing itself and hand every entry to log, whose level decides.
func routeLogrus(l *logrus.Logger, log *slog.Logger) {
	l.SetOutput(io.Discard)
	l.SetLevel(logrus.TraceLevel)
	l.ReplaceHooks(logrus.LevelHooks{})
	l.AddHook(logrusHook{log})
}

// verbosityName names klog's V(n) lines (slog levels -1..-3) "V1".."V3" rather than slog's
// "DEBUG+3".."DEBUG+1".
func verbosityName(_ []string, a slog.Attr) slog.Attr {
	if a.Key != slog.LevelKey {
		return a
	}
	if l, ok := a.Value.Any().(slog.Level); ok && l > slog.LevelDebug && l < slog.LevelInfo {
		return slog.String(slog.LevelKey, "V"+strconv.Itoa(int(-l)))
	}
	return a
}

// NRILogger is NRI's Logger interface over log: for NRI's global logger (Setup) and a plugin's
// stub (stub.WithLogger). Its lines carry component=nri.
func NRILogger(log *slog.Logger) nrilog.Logger { return nriLogger{log} }

type nriLogger struct{ log *slog.Logger }

func (l nriLogger) Debugf(ctx context.Context, format string, args ...any) {
	l.log.DebugContext(ctx, fmt.Sprintf(format, args...), "component", "nri")
}
func (l nriLogger) Infof(ctx context.Context, format string, args ...any) {
	l.log.InfoContext(ctx, fmt.Sprintf(format, args...), "component", "nri")
}
func (l nriLogger) Warnf(ctx context.Context, format string, args ...any) {
	l.log.WarnContext(ctx, fmt.Sprintf(format, args...), "component", "nri")
}
func (l nriLogger) Errorf(ctx context.Context, format string, args ...any) {
	l.log.ErrorContext(ctx, fmt.Sprintf(format, args...), "component", "nri")
}

// logrusHook forwards logrus entries (containerd's log package, ttrpc) to slog with their fields.
type logrusHook struct{ log *slog.Logger }

func (logrusHook) Levels() []logrus.Level { return logrus.AllLevels }

func (h logrusHook) Fire(e *logrus.Entry) error {
	level := slog.LevelInfo
	switch {
	case e.Level <= logrus.ErrorLevel:
		level = slog.LevelError
	case e.Level == logrus.WarnLevel:
		level = slog.LevelWarn
	case e.Level >= logrus.DebugLevel:
		level = slog.LevelDebug
	}
	ctx := e.Context
	if ctx == nil {
		ctx = context.Background()
	}
	attrs := make([]any, 0, 2*len(e.Data))
	for k, v := range e.Data {
		attrs = append(attrs, k, v)
	}
	h.log.Log(ctx, level, e.Message, attrs...)
	return nil
}

// CLIFlags declares -v and --log-format for a urfave/cli command, each also read from the
// environment variable envPrefix + its name (EnvSources).
func (o *LogOptions) CLIFlags(envPrefix string) []cli.Flag {
	return []cli.Flag{
		&cli.IntFlag{Name: "v", Value: 0, Destination: &o.Verbosity, Sources: EnvSources(envPrefix, "v"),
			Usage: "log verbosity: 0 info and above, 4 and more debug (also client-go's klog.V(n) lines)"},
		&cli.StringFlag{Name: "log-format", Value: "text", Destination: &o.Format, Sources: EnvSources(envPrefix, "log-format"),
			Usage: "log format: text or json"},
	}
}

// EnvSources is the environment variable a flag is also read from: envPrefix and the flag's name in
// upper case with "-" as "_" (TESSERA_NODE_ and cdi-dir: TESSERA_NODE_CDI_DIR). A flag given on the
// command line wins over its variable.
func EnvSources(envPrefix, flag string) cli.ValueSourceChain {
	return cli.EnvVars(envPrefix + strings.ToUpper(strings.ReplaceAll(flag, "-", "_")))
}
