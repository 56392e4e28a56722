// Command kubectl-tessera shows who holds which GPU and why pods wait, installed as a kubectl plugin
// (put it on $PATH; kubectl finds kubectl-<name> binaries):
//
//	kubectl tessera nodes [NODE...]   GPUs per node: mode, holders (pod/container, whole, share memory and
//	                                  cores, DRA claims, local placements, MIG, mdev) and what is free
//	kubectl tessera pending [-A]      pods asking for GPUs that are not running, with the scheduler's
//	                                  and Tessera's reasons
//	kubectl tessera why POD           one pod: why it is not running
//
// It takes kubectl's flags (cli-runtime's ConfigFlags: --kubeconfig, --context, -n/--namespace, --as,
// ...) and -o wide|json|yaml, and reads only the API server: the node agents' inventory and holdings
// annotations, the extender's assignment annotations and Events.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/tessera-gpu/tessera/internal/telemetry"
)

func main() {
	streams := genericiooptions.IOStreams{In: os.Stdin, Out: os.Stdout, ErrOut: os.Stderr}
	cmd := newCommand(streams, genericclioptions.NewConfigFlags(true), func(c *rest.Config) (kubernetes.Interface, error) {
		return kubernetes.NewForConfig(c)
	})
	if err := cmd.ExecuteContext(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

// newClient makes the client from the loaded kubeconfig (tests return a fake clientset).
type newClient func(*rest.Config) (kubernetes.Interface, error)

// options are the flags every command shares and what they resolve to.
type options struct {
	config    *genericclioptions.ConfigFlags
	newClient newClient
	output    string
	streams   genericiooptions.IOStreams
}

// outputs are -o's formats; "" is the default table.
var outputs = []string{"wide", "json", "yaml"}

// client loads the kubeconfig (only a command that runs does: a bad command or flag is refused
// before) and returns a client and the namespace -n or the kubeconfig's context names.
func (o *options) client() (kubernetes.Interface, string, error) {
	rc, err := o.config.ToRESTConfig()
	if err != nil {
		return nil, "", fmt.Errorf("kubeconfig: %w", err)
	}
	ns, _, err := o.config.ToRawKubeConfigLoader().Namespace()
	if err != nil {
		return nil, "", fmt.Errorf("kubeconfig: namespace: %w", err)
	}
	c, err := o.newClient(rc)
	if err != nil {
		return nil, "", fmt.Errorf("client: %w", err)
	}
	return c, ns, nil
}

// checkOutput refuses an -o no command can print.
func (o *options) checkOutput() error {
	if o.output == "" {
		return nil
	}
	for _, f := range outputs {
		if o.output == f {
			return nil
		}
	}
	return fmt.Errorf("unknown output format %q for -o; use one of: %s", o.output, strings.Join(outputs, ", "))
}

// timeout bounds one command's requests.
const timeout = time.Minute

func newCommand(streams genericiooptions.IOStreams, config *genericclioptions.ConfigFlags, nc newClient) *cobra.Command {
	o := &options{config: config, newClient: nc, streams: streams}
	root := &cobra.Command{
		Use:   "tessera",
		Short: "Who holds which GPU, and why GPU pods wait",
		Long: `kubectl tessera shows Tessera's view of the cluster from the API server alone: the node
agents' GPU inventories and holdings (whole GPUs, shares, DRA claims, local placements), the
extender's assignments and the Events that say why GPU pods wait. Without a command it runs nodes.`,
		Annotations:       map[string]string{cobra.CommandDisplayNameAnnotation: "kubectl tessera"},
		Version:           versionText(),
		SilenceUsage:      true,
		SilenceErrors:     true,
		CompletionOptions: cobra.CompletionOptions{DisableDefaultCmd: true},
	}
	root.SetVersionTemplate("{{.Version}}\n")
	root.Flags().Bool("version", false, "Print the version") // no -v: kubectl's -v is verbosity
	root.SetIn(streams.In)
	root.SetOut(streams.Out)
	root.SetErr(streams.ErrOut)
	config.AddFlags(root.PersistentFlags())
	root.PersistentFlags().StringVarP(&o.output, "output", "o", "", "Output format: "+strings.Join(outputs, ", ")+" (default: a table)")
	root.SetFlagErrorFunc(flagError)
	// Every command's -o is checked before its RunE loads the kubeconfig.
	root.PersistentPreRunE = func(*cobra.Command, []string) error { return o.checkOutput() }
	nodes := nodesCommand(o)
	root.AddCommand(nodes, pendingCommand(o), whyCommand(o), &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run:   func(cmd *cobra.Command, _ []string) { telemetry.PrintVersion(cmd.OutOrStdout(), "kubectl-tessera") },
	})
	// Without a command, nodes runs; anything else that is not a command is refused by name.
	root.Args = func(cmd *cobra.Command, args []string) error {
		if len(args) > 0 {
			return unknownCommand(cmd, args[0])
		}
		return nil
	}
	root.RunE = nodes.RunE
	return root
}

// unknownCommand names the word that is not a command and lists the commands.
func unknownCommand(root *cobra.Command, word string) error {
	var names []string
	for _, c := range root.Commands() {
		if c.IsAvailableCommand() {
			names = append(names, c.Name())
		}
	}
	return fmt.Errorf("unknown command %q for %q; commands: %s (see %s --help)", word, root.CommandPath(), strings.Join(names, ", "), root.CommandPath())
}

// singleDash matches pflag's error for a Go-style flag ("-context"): it reads it as shorthands.
var singleDash = regexp.MustCompile(`unknown shorthand flag: '.' in -([a-z][a-z-]+)`)

// flagError points at --help, and at two dashes when a long flag was given one.
func flagError(cmd *cobra.Command, err error) error {
	if m := singleDash.FindStringSubmatch(err.Error()); m != nil {
		name, _, _ := strings.Cut(m[1], "=")
		if cmd.Flags().Lookup(name) != nil {
			return fmt.Errorf("%w (long flags take two dashes: --%s)", err, name)
		}
	}
	return fmt.Errorf("%w (see %s --help)", err, cmd.CommandPath())
}

// versionText is what --version prints, as every Tessera binary prints it.
func versionText() string {
	var b strings.Builder
	telemetry.PrintVersion(&b, "kubectl-tessera")
	return strings.TrimSuffix(b.String(), "\n")
}

// output is where a command prints.
func (o *options) out() io.Writer { return o.streams.Out }
